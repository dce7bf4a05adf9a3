"""The all-reduce algorithms of a tensor-parallel group (``paths``) and the start-up
choice among them (``auto``). ``docs/tensor-parallel.md`` explains each one."""
