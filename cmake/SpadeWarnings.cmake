# Warning and sanitizer flags shared by every Spade target (C++ only; CUDA gets its own in SpadeCuda.cmake).
add_library(spade_warnings INTERFACE)
target_compile_options(spade_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wcast-align
                            -Wformat=2 -Wimplicit-fallthrough>)
if(SPADE_WERROR)
  target_compile_options(spade_warnings INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Werror>
                                                  $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>)
endif()

set(_spade_san "")
if(SPADE_ASAN)
  list(APPEND _spade_san address)
endif()
if(SPADE_UBSAN)
  list(APPEND _spade_san undefined)
endif()
if(_spade_san)
  list(JOIN _spade_san "," _spade_san_list)
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${_spade_san_list}> $<$<COMPILE_LANGUAGE:CXX>:-fno-omit-frame-pointer>
                      $<$<COMPILE_LANGUAGE:CXX>:-fno-sanitize-recover=all>)
  add_link_options(-fsanitize=${_spade_san_list})
endif()
