# cmake -DROOT=<source dir> -P no_legacy_stream.cmake
# The CUDA code orders all its work on non-blocking streams it creates (the backend's stream 0,
# the device arena's own): nothing may go to the legacy default stream, which those streams do
# not wait for (docs/cuda.md "Defects found by reading": twice a plain cudaMemcpy raced the
# backend's kernels). Fails naming each call that would: a synchronous copy or memset, a
# device-wide synchronize, or a kernel launch without an explicit stream.
file(GLOB sources ${ROOT}/kernels/cuda/*.cu ${ROOT}/kernels/cuda/*.cc ${ROOT}/kernels/cuda/*.h
     ${ROOT}/kernels/cuda/*.cuh ${ROOT}/tests/gpu/kvstore_device_arena.cc
     ${ROOT}/tests/gpu/kvstore_device_arena.h)
if(NOT sources)
  message(FATAL_ERROR "no CUDA sources under ${ROOT}")
endif()
set(found "")
foreach(f ${sources})
  file(READ ${f} text)
  string(REGEX MATCHALL "cuda(Memcpy|Memset|Memcpy2D|Memcpy3D|MemcpyToSymbol|MemcpyFromSymbol|DeviceSynchronize)\\("
         calls "${text}")
  foreach(c ${calls})
    list(APPEND found "${f}: ${c}")
  endforeach()
  # A launch <<<grid, block>>> or <<<grid, block, smem>>> runs on the legacy stream; so does an
  # explicit 0 or nullptr stream.
  string(REGEX MATCHALL "<<<[^;]*>>>" launches "${text}")
  foreach(l ${launches})
    string(REGEX REPLACE "\\([^()]*\\)" "" flat "${l}")  # commas inside calls do not count
    string(REGEX REPLACE "\\([^()]*\\)" "" flat "${flat}")
    string(REGEX MATCHALL "," commas "${flat}")
    list(LENGTH commas n)
    if(n LESS 3 OR flat MATCHES ",[ \n]*(0|nullptr|NULL)[ \n]*>>>")
      list(APPEND found "${f}: ${l}")
    endif()
  endforeach()
endforeach()
if(found)
  list(JOIN found "\n  " lines)
  message(FATAL_ERROR "work on the legacy default stream:\n  ${lines}")
endif()
list(LENGTH sources n)
message(STATUS "no legacy-stream call in ${n} CUDA sources")
