"""Event classes shared by the event store tests (module level: tags are registered once)."""

from __future__ import annotations

import bus


class CourseCreated(bus.Event, tag="test.course.created"):
    course_name: str


class UserRegistered(bus.Event, tag="test.user.registered"):
    user_id: str
    name: str


class UserJoinedCourse(bus.Event, tag="test.user.joined_course"):
    course_name: str
    user_id: str


class CourseClosed(bus.Event, tag="test.course.closed"):
    course_name: str


class DeviceReading(bus.Event, tag="test.device.reading"):
    device_id: str
    value: float


class DeviceRenamed(bus.Event, tag="test.device.renamed"):
    device_id: str
    name: str


class Ping(bus.Event, tag="test.ping"):
    pass


class Counted(bus.Event, tag="test.counted"):
    count: int
    enabled: bool
    note: str | None = None


COURSE_TYPES = [CourseCreated, UserRegistered, UserJoinedCourse, CourseClosed]
