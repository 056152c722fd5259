"""A BusBroker's subscribers: their configs, AsyncAPI description and the subscriber itself."""
