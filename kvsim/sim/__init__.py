"""The SimPy shell: replicas that own time, and the cluster around them."""
