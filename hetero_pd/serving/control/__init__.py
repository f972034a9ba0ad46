"""The control protocol between the router and its workers: typed messages, their
authentication, and a worker's control endpoint."""
