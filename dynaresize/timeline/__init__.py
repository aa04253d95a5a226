"""Stage timeline: schema (numpy/h5py only), writer, and the per-rank event recorder."""
