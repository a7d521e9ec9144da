# Warnings as errors for our own code only (generated protobuf code is exempt).
function(epd_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror -Wno-unused-parameter -Wno-missing-field-initializers>)
endfunction()

# epd_library(<folder> SOURCES ... DEPS ...): one library per folder, epd_<folder> + epd::<folder>.
function(epd_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  if(NOT ARG_SOURCES)
    # A folder whose code is all headers (or not written yet) is an interface library.
    add_library(epd_${name} INTERFACE)
    target_include_directories(epd_${name} INTERFACE ${EPD_ROOT})
    target_link_libraries(epd_${name} INTERFACE ${ARG_PUBLIC_DEPS})
    add_library(epd::${name} ALIAS epd_${name})
    return()
  endif()
  add_library(epd_${name} STATIC ${ARG_SOURCES})
  add_library(epd::${name} ALIAS epd_${name})
  target_include_directories(epd_${name} PUBLIC ${EPD_ROOT})
  target_link_libraries(epd_${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  epd_warnings(epd_${name})
endfunction()

# epd_test(<name> SOURCES ... DEPS ... [LABELS unit|integration|gpu]): a GoogleTest binary.
function(epd_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  if(EPD_UNIT_ONLY AND NOT "unit" IN_LIST ARG_LABELS)
    return()
  endif()
  add_executable(${name} ${ARG_SOURCES})
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  # One main for every test binary (tests/testing/test_main.cc: gtest's, and SIGPIPE caught),
  # compiled once.
  if(NOT TARGET epd_test_main)
    add_library(epd_test_main OBJECT ${EPD_ROOT}/tests/testing/test_main.cc)
    target_link_libraries(epd_test_main PRIVATE GTest::gtest)
    epd_warnings(epd_test_main)
  endif()
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gmock epd_test_main)
  target_include_directories(${name} PRIVATE ${EPD_ROOT})
  # gtest_discover_tests in CMake 3.25 cannot carry several ENVIRONMENT entries, so the folders
  # reach tests as compile-time defaults (tests/testing/subprocess.h: BinaryPath, SourcePath).
  target_compile_definitions(${name} PRIVATE EPD_DEFAULT_SOURCE_DIR="${EPD_ROOT}"
                                             EPD_DEFAULT_BINARY_DIR="${CMAKE_BINARY_DIR}")
  epd_warnings(${name})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 120
    PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT}
    ENVIRONMENT "UCX_NET_DEVICES=lo")
endfunction()
