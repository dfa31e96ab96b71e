# CUTLASS/CuTe headers come from the PyPI wheel nvidia-cutlass (pinned in requirements.txt).
# Override with -DCUTLASS_DIR=/path/to/cutlass (a checkout or the wheel's cutlass_library/source).
set(CUTLASS_DIR "" CACHE PATH "CUTLASS root holding include/ and tools/util/include/")
if(NOT CUTLASS_DIR)
  find_package(Python 3.9 COMPONENTS Interpreter)
  if(Python_Interpreter_FOUND)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
              "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source'))"
      OUTPUT_VARIABLE _qmoe_cutlass OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _qmoe_rc ERROR_QUIET)
    if(_qmoe_rc EQUAL 0)
      set(CUTLASS_DIR "${_qmoe_cutlass}" CACHE PATH "" FORCE)
    endif()
  endif()
endif()
if(NOT EXISTS "${CUTLASS_DIR}/include/cute/tensor.hpp")
  message(FATAL_ERROR "CUTLASS headers not found (CUTLASS_DIR='${CUTLASS_DIR}'). "
                      "pip install nvidia-cutlass==4.2.0.0, or pass -DCUTLASS_DIR=...")
endif()
set(QMOE_CUTLASS_INCLUDE_DIRS "${CUTLASS_DIR}/include" "${CUTLASS_DIR}/tools/util/include")
message(STATUS "qmoe: CUTLASS headers from ${CUTLASS_DIR}")
