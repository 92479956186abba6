"""The main process's plan of an epoch: sample order, world split, index sources, resume state
and progress. Pure functions of (seed, epoch, position); no processes here."""
