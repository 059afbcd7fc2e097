"""The SDK is tested against the real app with the engine double: the same fixtures."""

from tests.api_proc.conftest import engine_double, make_config, start_app  # noqa: F401
