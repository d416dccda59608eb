"""Circuit breakers around provider upstreams and the degradation policy."""
