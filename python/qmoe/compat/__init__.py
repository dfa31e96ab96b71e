"""Drop-in replacements for other libraries' MoE ops (same names, signatures and layouts)."""
