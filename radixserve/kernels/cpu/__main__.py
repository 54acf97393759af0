"""`python -m radixserve.kernels.cpu`: build (or load) the C++ CPU kernels for this CPU now."""

from radixserve.kernels.cpu.loader import main

main()
