# Every script test CTest runs (a command that runs a .py file) fails when its interpreter prints
# nothing and exits 0: each is run here with /bin/true in the interpreter's place, and must exit
# with a failure (neither 0 nor the skip code 77). A test that passes so would pass without
# checking anything (tests/testing/require_closing_line.sh is what makes them fail).
#
# Usage: cmake -DBUILD_DIR=<build tree> -P silent_oracle_test.cmake
if(NOT BUILD_DIR)
  message(FATAL_ERROR "silent_oracle_test.cmake: -DBUILD_DIR=<build tree> is required")
endif()
execute_process(COMMAND ${CMAKE_CTEST_COMMAND} --show-only=json-v1
                WORKING_DIRECTORY ${BUILD_DIR} OUTPUT_VARIABLE listing RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "ctest --show-only=json-v1 in ${BUILD_DIR} failed (${status})")
endif()
string(JSON count LENGTH "${listing}" tests)
set(checked "")
set(passed_silently "")
math(EXPR last "${count} - 1")
foreach(i RANGE ${last})
  string(JSON name GET "${listing}" tests ${i} name)
  string(JSON length ERROR_VARIABLE no_command LENGTH "${listing}" tests ${i} command)
  if(no_command)
    continue()
  endif()
  set(command "")
  set(interpreter -1)
  math(EXPR length_last "${length} - 1")
  foreach(j RANGE ${length_last})
    string(JSON argument GET "${listing}" tests ${i} command ${j})
    if(argument MATCHES "\\.py$" AND interpreter EQUAL -1 AND j GREATER 0)
      math(EXPR interpreter "${j} - 1")
    endif()
    list(APPEND command "${argument}")
  endforeach()
  if(interpreter EQUAL -1)
    continue()
  endif()
  list(REMOVE_AT command ${interpreter})
  list(INSERT command ${interpreter} /bin/true)
  execute_process(COMMAND ${command} RESULT_VARIABLE result OUTPUT_VARIABLE out
                  ERROR_VARIABLE err TIMEOUT 60)
  message(STATUS "${name} with a silent interpreter: exit ${result}")
  list(APPEND checked ${name})
  if(result EQUAL 0 OR result EQUAL 77)
    list(APPEND passed_silently "${name} (exit ${result})")
  endif()
endforeach()
list(LENGTH checked checked_count)
# tests/train and tests/summary hold 7 script tests today: finding fewer means the listing or the
# .py match went wrong, and the check would pass having run nothing.
if(checked_count LESS 7)
  message(FATAL_ERROR "only ${checked_count} script tests found (${checked}); expected 7 or more")
endif()
if(passed_silently)
  message(FATAL_ERROR "with a silent interpreter (prints nothing, exits 0) these script tests "
                      "still pass: ${passed_silently}; run them under "
                      "\${SHOAL_REQUIRE_CLOSING_LINE} and print the closing line last")
endif()
message(STATUS "ORACLE OK silent interpreter: ${checked_count} script tests fail")
