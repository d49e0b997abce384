"""Horovod's ``horovod.common`` module paths, for scripts that import from them."""
