# The library's layers, lowest first. Each is a static library (fsdp_<name>) built from
# src/<name>/ with public headers in include/fsdp/<name>/, and may use only the layers it
# names after DEPENDS. scripts/check_layers.py reads these same lines and checks every
# #include against them, so an upward include fails the build (docs/architecture.md).
fsdp_layer(comm)
fsdp_layer(autograd)
fsdp_layer(memory)
fsdp_layer(engine    DEPENDS comm memory)
fsdp_layer(precision DEPENDS comm)
fsdp_layer(core      DEPENDS autograd comm memory engine precision)
fsdp_layer(optim     DEPENDS autograd comm memory engine precision)
fsdp_layer(state     DEPENDS comm memory core optim)
fsdp_layer(trainer   DEPENDS autograd comm memory precision core optim state)
