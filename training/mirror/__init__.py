"""The run mirror (training stage): a run whose --out is a store URL trains in a local cache mirrored there."""
