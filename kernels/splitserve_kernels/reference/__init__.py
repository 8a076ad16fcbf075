"""Pure-torch reference implementations; each GPU kernel has one with the same signature."""
