# The layer map enforced by the build, not only by scripts/check_layers.py: what a layer's
# sources can include, and what its objects can call. Included by the top CMakeLists.txt and
# by the planted-violation project of tests/scripts/test_layer_check.sh, so both run the
# same rules.

# fsdp_layer_include_root(NAME TARGET DEPENDS): TARGET's includes resolve in a root of its
# own in the build tree, holding links to the folders of NAME and of every layer it may
# reach through DEPENDS ("core/unit.h" from src/core, "fsdp/core/options.h" from
# include/fsdp/core). A header of a layer above is simply not there: the compiler refuses
# the upward include.
function(fsdp_layer_include_root name target deps)
  set(reach ${name})
  foreach(dep ${deps})
    get_property(dep_reach GLOBAL PROPERTY FSDP_LAYER_REACH_${dep})
    list(APPEND reach ${dep_reach})
  endforeach()
  list(REMOVE_DUPLICATES reach)
  set_property(GLOBAL PROPERTY FSDP_LAYER_REACH_${name} ${reach})
  set(root ${CMAKE_BINARY_DIR}/layer_roots/${name})
  file(REMOVE_RECURSE ${root})
  file(MAKE_DIRECTORY ${root}/fsdp)
  foreach(layer ${reach})
    file(CREATE_LINK ${CMAKE_SOURCE_DIR}/src/${layer} ${root}/${layer} SYMBOLIC)
    if(IS_DIRECTORY ${CMAKE_SOURCE_DIR}/include/fsdp/${layer})
      file(CREATE_LINK ${CMAKE_SOURCE_DIR}/include/fsdp/${layer} ${root}/fsdp/${layer} SYMBOLIC)
    endif()
  endforeach()
  target_include_directories(${target} PRIVATE ${root})
endfunction()

# fsdp_layer_link_check(TARGET): TARGET (a static layer) linked whole into a shared object
# with -Wl,--no-undefined against only what TARGET links, its declared layers among them. A
# call into a layer above, through a hand-written declaration the include rules cannot see,
# is then an undefined symbol. Built by the target fsdp_link_check only (not by `all`).
if(NOT TARGET fsdp_link_check)
  add_custom_target(fsdp_link_check)
  set(FSDP_LINK_CHECK_STUB ${CMAKE_BINARY_DIR}/layer_roots/link_check_stub.cpp)
  file(WRITE ${FSDP_LINK_CHECK_STUB}
       "// The whole layer is linked in through WHOLE_ARCHIVE; this object adds nothing.\n")
endif()
function(fsdp_layer_link_check target)
  set(check ${target}_link_check)
  add_library(${check} SHARED EXCLUDE_FROM_ALL ${FSDP_LINK_CHECK_STUB})
  target_link_libraries(${check} PRIVATE "$<LINK_LIBRARY:WHOLE_ARCHIVE,${target}>")
  target_link_options(${check} PRIVATE "LINKER:--no-undefined")
  set_target_properties(${check} PROPERTIES UNITY_BUILD OFF LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/layer_roots)
  add_dependencies(fsdp_link_check ${check})
endfunction()
