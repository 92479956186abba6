"""MLPerf Storage's workloads in ``stallfree bench --workload``: the configs' values, the data they
read, the loaders side by side, accelerator utilisation (AU) and the search for the most emulated
accelerators a host keeps at the threshold."""
