"""What a checkpoint stores: the scheme, the packing math, the per-module tensor contract,
compressed-tensors metadata and checkpoint I/O."""
