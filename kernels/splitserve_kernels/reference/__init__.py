"""Pure-torch reference implementations; every GPU kernel has one of these with the same signature."""
