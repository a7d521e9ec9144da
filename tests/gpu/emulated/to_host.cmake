# cmake -DIN=kernels/cuda/x.cu -DOUT=build/.../x.cc -P to_host.cmake
# Makes a .cu file host C++ for the emulation in cuda_runtime.h: a launch `K<<<g, b, s, st>>>(`
# becomes `emu::Launch(K, g, b, s, st)(`, and `extern __shared__ T name[];` the block's dynamic
# shared memory.
file(READ "${IN}" src)
string(REGEX REPLACE "extern __shared__ ([A-Za-z0-9_]+) ([A-Za-z0-9_]+)\\[\\];"
       "\\1* \\2 = emu::DynSmem<\\1>();" src "${src}")
string(REGEX REPLACE "([A-Za-z_][A-Za-z0-9_]*(<[A-Za-z0-9_, ]+>)?)<<<([^;]*)>>>\\("
       "emu::Launch(\\1, \\3)(" src "${src}")
if(src MATCHES "<<<")
  message(FATAL_ERROR "${IN}: a kernel launch to_host.cmake cannot rewrite")
endif()
file(WRITE "${OUT}" "// Generated from ${IN} by tests/gpu/emulated/to_host.cmake\n${src}")
