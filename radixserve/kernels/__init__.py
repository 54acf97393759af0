"""Native kernels, one home: `kernels/cpu/` (C++ for the CPU, one source per op family)."""
