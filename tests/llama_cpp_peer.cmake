# CMake settings for building llama-cpp-python for the peer tests (tests/llama_peer.py), which
# need only libllama and the portable CPU backend. The README's test command passes this file
# to llama-cpp-python's build:  CMAKE_ARGS="-C $PWD/tests/llama_cpp_peer.cmake" pip install ...
#
# CMake reads it twice. First as an initial-cache script (`cmake -C`, PROJECT_NAME not yet
# defined): it sets the options below. Then, through CMAKE_PROJECT_llama.cpp_INCLUDE, right
# after vendor/llama.cpp's project() call: there it turns off llama.cpp's `common` library
# (chat parsers, argument parsing, an HTTP client), which llama-cpp-python's CMakeLists forces
# on with a FORCE'd cache entry that a -D cannot override, but which the Python bindings
# never load. A plain variable of that directory scope shadows the cache entry, and option()
# then leaves it alone (policy CMP0077). The built libllama is the same as with `common`.

if(NOT DEFINED PROJECT_NAME)
    # -march=native by GCC 12 on a CPU with AMX builds code that dies with SIGILL; this
    # builds for any x86-64 CPU with AVX2 instead
    set(GGML_NATIVE OFF CACHE BOOL "")
    # one CPU backend linked in, not a set of dlopen()ed variants
    set(GGML_BACKEND_DL OFF CACHE BOOL "")
    set(GGML_CPU_ALL_VARIANTS OFF CACHE BOOL "")
    # ggml's own thread pool instead of OpenMP (no libgomp needed)
    set(GGML_OPENMP OFF CACHE BOOL "")
    set(GGML_CCACHE OFF CACHE BOOL "")
    # no multimodal library, tools, examples, tests or server
    set(LLAVA_BUILD OFF CACHE BOOL "")
    set(LLAMA_BUILD_TOOLS OFF CACHE BOOL "")
    set(LLAMA_BUILD_EXAMPLES OFF CACHE BOOL "")
    set(LLAMA_BUILD_TESTS OFF CACHE BOOL "")
    set(LLAMA_BUILD_SERVER OFF CACHE BOOL "")
    # -O2 instead of -O3: compiles faster; the peer tests' logits are bit-identical
    set(CMAKE_C_FLAGS_RELEASE "-O2 -DNDEBUG" CACHE STRING "")
    set(CMAKE_CXX_FLAGS_RELEASE "-O2 -DNDEBUG" CACHE STRING "")
    set(CMAKE_PROJECT_llama.cpp_INCLUDE "${CMAKE_CURRENT_LIST_FILE}" CACHE FILEPATH "")
elseif(PROJECT_NAME STREQUAL "llama.cpp")
    set(LLAMA_BUILD_COMMON OFF)
endif()
