"""FastStream's shared broker testcases, vendored (Apache-2.0, see LICENSE): subclassed in tests/faststream."""
