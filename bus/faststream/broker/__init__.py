"""The BusBroker, its registrator and the broker-level router."""
