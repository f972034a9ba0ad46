"""A worker process (`python -m hetero_pd.serving.worker.main`): one engine, its control
endpoint, its requests, and its side of the KV hand-off and of prefix sharing."""
