"""`BusRouter`: FastStream's FastAPI integration on a BusBroker (`app.include_router(router)`)."""

from bus.faststream.fastapi.fastapi import BusRouter

__all__ = ["BusRouter"]
