"""A BusBroker's publishers: the producer that writes to the bus, and the publisher itself."""
