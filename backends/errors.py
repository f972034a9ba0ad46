"""The error a backend raises for hardware this host lacks."""


class BackendUnavailableError(RuntimeError):
    """A device operation was asked of a backend this host cannot run (no driver, no device,
    or the vendor extension such as torch_npu is not installed)."""
