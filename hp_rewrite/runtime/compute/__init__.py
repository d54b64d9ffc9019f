"""The local experts: their grouped-GEMM compute for every weight layout, their rows, experts held as modules or kept quantised."""
