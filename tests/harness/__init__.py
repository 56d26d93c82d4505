"""What tests and benchmarks run the product with: several message drivers in lockstep in one thread, and a compromised
worker's forgeries (never part of the product: no worker can be told to forge)."""
