"""Side-by-side benchmarks. Each measures its own baseline in the same run and
reports ratios, because absolute figures on shared machines drift 2-3x."""
