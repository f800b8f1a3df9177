"""The HTTP face of the service: routes, error mapping, metrics, and running under hypercorn."""
