"""The deployment tool: the YAML schema and its validation, the automatic P/D ratio with
its calibration, and Kubernetes manifests.

    schema.py     Deployment (one typed object per section), load_deployment()
    validate.py   checks against a host or a Kubernetes target, with file:line:key errors
    ratio.py      how many prefill and decode workers a workload needs, with the reasoning
    calibrate.py  a short measurement of the real model's prefill and decode speed
    k8s.py        StatefulSets, Services, a ConfigMap and probes for `render k8s`
"""
