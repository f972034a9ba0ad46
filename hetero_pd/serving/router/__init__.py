"""The router: its handles on the workers, routing policies, the prefill-to-decode
hand-off, the prefix index and its Prometheus metrics."""
