# SPDX-License-Identifier: Apache-2.0
# install(): headers, the exported dcpattn::dcpattn target, and a relocatable package config.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(DCPATTN_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/dcpattn"
    CACHE STRING "Where dcpattnConfig.cmake is installed")

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/dcpattn" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(TARGETS dcpattn EXPORT dcpattnTargets)
install(EXPORT dcpattnTargets NAMESPACE dcpattn:: DESTINATION "${DCPATTN_INSTALL_CMAKEDIR}")

configure_package_config_file(
  "${PROJECT_SOURCE_DIR}/cmake/dcpattnConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/dcpattnConfig.cmake"
  INSTALL_DESTINATION "${DCPATTN_INSTALL_CMAKEDIR}")
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/dcpattnConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion
  ARCH_INDEPENDENT)
install(FILES
  "${PROJECT_BINARY_DIR}/dcpattnConfig.cmake"
  "${PROJECT_BINARY_DIR}/dcpattnConfigVersion.cmake"
  "${PROJECT_SOURCE_DIR}/cmake/dcpattnDependencies.cmake"
  DESTINATION "${DCPATTN_INSTALL_CMAKEDIR}")
