# Included before find_package(Torch) by CMakeLists.txt and by the installed base_moeConfig.cmake (a C++ user's
# find_package(Torch) fails on a pip-installed CUDA torch without these settings).
# A pip-installed CUDA torch: the toolkit's root, a fixed arch list (no GPU probe at configure time),
# and the CUDA runtime libraries that the wheel keeps under site-packages/nvidia/cu*/lib.
if(NOT DEFINED CUDA_TOOLKIT_ROOT_DIR AND EXISTS /usr/local/cuda)
  set(CUDA_TOOLKIT_ROOT_DIR /usr/local/cuda)
endif()
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(ENV{TORCH_CUDA_ARCH_LIST} "9.0a")
endif()
foreach(prefix ${CMAKE_PREFIX_PATH})
  file(GLOB _nvrtc "${prefix}/../../../nvidia/cu*/lib/libnvrtc.so*")
  if(_nvrtc AND NOT CUDA_nvrtc_LIBRARY)
    list(GET _nvrtc 0 _first)
    set(CUDA_nvrtc_LIBRARY ${_first} CACHE FILEPATH "NVRTC from the CUDA pip wheel")
  endif()
  # the wheels' headers (cusparse.h, ...), which torch's CUDA headers include and a bare toolkit may lack
  file(GLOB _wheel_include "${prefix}/../../../nvidia/cu*/include")
  list(APPEND BASE_MOE_CUDA_WHEEL_INCLUDES ${_wheel_include})
endforeach()
