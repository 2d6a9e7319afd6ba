"""A run's surroundings on the driver: the cluster, where files go, reruns, worker errors."""
