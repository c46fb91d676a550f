// Anchor translation unit so the shared PCH has a target to be built by.
