# Install rules, the package files of find_package(Shoal) and pkg-config, and the Debian package
# (`make deb`, CPack). Included from the top-level CMakeLists.txt when SHOAL_INSTALL is on.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/shoal
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev)
install(TARGETS ${SHOAL_LIBRARY_TARGETS} EXPORT ShoalTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET shoal_cli)
  install(TARGETS shoal_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

set(SHOAL_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/Shoal)
install(EXPORT ShoalTargets NAMESPACE Shoal:: DESTINATION ${SHOAL_CMAKE_DIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/ShoalConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/ShoalConfig.cmake
                              INSTALL_DESTINATION ${SHOAL_CMAKE_DIR})
# 0.x: a minor version may break the API, so only the same minor version is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/ShoalConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/ShoalConfig.cmake ${PROJECT_BINARY_DIR}/ShoalConfigVersion.cmake
        DESTINATION ${SHOAL_CMAKE_DIR})

# pkg-config: LibTorch ships no .pc file, so its flags are written out here as found.
set(SHOAL_PC_CFLAGS "")
foreach(dir ${TORCH_INCLUDE_DIRS})
  if(NOT dir STREQUAL "/usr/include")
    string(APPEND SHOAL_PC_CFLAGS " -I${dir}")
  endif()
endforeach()
string(APPEND SHOAL_PC_CFLAGS " ${TORCH_CXX_FLAGS}")
if(TARGET torch_cpu)
  get_target_property(SHOAL_TORCH_DEFINES torch_cpu INTERFACE_COMPILE_DEFINITIONS)
  foreach(define ${SHOAL_TORCH_DEFINES})
    string(APPEND SHOAL_PC_CFLAGS " -D${define}")
  endforeach()
endif()
string(APPEND SHOAL_PC_CFLAGS " -DSHOAL_HAVE_MPI=$<BOOL:${SHOAL_HAVE_MPI}> -DSHOAL_HAVE_NCCL=$<BOOL:${SHOAL_HAVE_NCCL}>")
get_filename_component(SHOAL_TORCH_LIBDIR "${TORCH_LIBRARY}" DIRECTORY)
# libtorch.so registers the operators; nothing references it directly, hence --no-as-needed.
set(SHOAL_PC_LIBS "-L${SHOAL_TORCH_LIBDIR} -Wl,--no-as-needed -ltorch -Wl,--as-needed -ltorch_cpu -lc10 -pthread")
# A LibTorch outside the system directories (PyPI's) is found at run time by an RPATH; without it
# the loader would take the system's libc10.so (Debian's 1.13) beside PyPI's other libraries.
if(NOT SHOAL_TORCH_LIBDIR IN_LIST CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES)
  string(APPEND SHOAL_PC_LIBS " -Wl,-rpath,${SHOAL_TORCH_LIBDIR}")
  file(GLOB SHOAL_PC_WHEEL_LIBS LIST_DIRECTORIES true "${SHOAL_TORCH_LIBDIR}/../../nvidia/*/lib")
  foreach(dir ${SHOAL_PC_WHEEL_LIBS})
    get_filename_component(dir "${dir}" ABSOLUTE)
    string(APPEND SHOAL_PC_LIBS " -Wl,-rpath-link,${dir}")
  endforeach()
endif()
set(SHOAL_PC_LIBS_PRIVATE "-lspdlog -lfmt -lrt")
if(SHOAL_HAVE_MPI)
  foreach(library ${MPI_C_LIBRARIES})
    string(APPEND SHOAL_PC_LIBS_PRIVATE " ${library}")
  endforeach()
endif()
# The prefix is found from the file's own place, so that the tree can be installed anywhere.
file(RELATIVE_PATH SHOAL_PC_TO_PREFIX /${CMAKE_INSTALL_LIBDIR}/pkgconfig /)
string(REGEX REPLACE "/$" "" SHOAL_PC_TO_PREFIX "${SHOAL_PC_TO_PREFIX}")
# libshoal.a's users link what it was built with: zlib and PCRE2 always, libdeflate where it was
# found.
set(SHOAL_PC_REQUIRES_PRIVATE "zlib, libpcre2-8")
if(LIBDEFLATE_FOUND)
  string(APPEND SHOAL_PC_REQUIRES_PRIVATE ", libdeflate")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/shoal.pc.in ${PROJECT_BINARY_DIR}/shoal.pc.in @ONLY)
file(GENERATE OUTPUT ${PROJECT_BINARY_DIR}/shoal.pc INPUT ${PROJECT_BINARY_DIR}/shoal.pc.in)
install(FILES ${PROJECT_BINARY_DIR}/shoal.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# ---- Debian package (make deb) -------------------------------------------------------------------
# One package with the libraries, headers, CMake and pkg-config files and the CLI. Its Depends are
# the Debian packages a user's build against it needs (LibTorch's headers and CMake files, MPI's,
# zlib's, PCRE2's, spdlog's, libdeflate's for libshoal.a), plus what dpkg-shlibdeps finds for the binaries.
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME shoal)
set(CPACK_PACKAGE_VENDOR "Shoal developers")
set(CPACK_PACKAGE_CONTACT "Shoal developers <shoal@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "Distributed training for LibTorch (the PyTorch C++ API)")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION libdevel)
set(SHOAL_DEB_DEPENDS "libtorch-dev (>= 1.13), zlib1g-dev, libpcre2-dev, libspdlog-dev (>= 1:1.10), cmake (>= 3.18) | pkg-config")
if(SHOAL_HAVE_MPI)
  string(APPEND SHOAL_DEB_DEPENDS ", libopenmpi-dev")
endif()
if(LIBDEFLATE_FOUND)
  string(APPEND SHOAL_DEB_DEPENDS ", libdeflate-dev")
endif()
set(CPACK_DEBIAN_PACKAGE_DEPENDS "${SHOAL_DEB_DEPENDS}")
find_program(SHOAL_DPKG_SHLIBDEPS dpkg-shlibdeps)
if(SHOAL_DPKG_SHLIBDEPS)
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
endif()
include(CPack)
