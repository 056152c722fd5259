"""Event classes: tags, cached attribute names, conditions (seed tests 33-37) and decoding."""

from __future__ import annotations

import pytest

import bus
from bus.eventstore import decode_event, event_class
from tests.eventstore.es_events import Counted, CourseCreated, Ping, UserJoinedCourse


def test_payload_attribute_names_lists_the_declared_attributes_in_order() -> None:
    assert CourseCreated.payload_attribute_names() == ("course_name",)
    assert UserJoinedCourse.payload_attribute_names() == ("course_name", "user_id")


def test_payload_attribute_names_is_empty_for_a_bare_event_class() -> None:
    assert Ping.payload_attribute_names() == ()
    assert bus.Event.payload_attribute_names() == ()


def test_payload_attribute_names_is_cached_at_class_creation() -> None:
    assert CourseCreated.payload_attribute_names() is CourseCreated.payload_attribute_names()
    assert isinstance(CourseCreated.__payload_attributes__, tuple)


def test_to_conditions_only_covers_attributes_the_class_declares() -> None:
    assert CourseCreated.to_conditions(course_name="Algebra", user_id="joe") == [
        bus.QueryCondition("test.course.created", "course_name", "Algebra")
    ]


def test_to_conditions_covers_every_matching_attribute() -> None:
    assert UserJoinedCourse.to_conditions(course_name="Algebra", user_id="joe") == [
        bus.QueryCondition("test.user.joined_course", "course_name", "Algebra"),
        bus.QueryCondition("test.user.joined_course", "user_id", "joe"),
    ]


def test_to_conditions_is_empty_when_no_attribute_matches() -> None:
    assert CourseCreated.to_conditions(user_id="joe") == []
    assert Ping.to_conditions(course_name="Algebra") == []


def test_to_conditions_turns_scalar_values_into_their_indexed_text() -> None:
    assert Counted.to_conditions(count=42, enabled=True) == [
        bus.QueryCondition("test.counted", "count", "42"),
        bus.QueryCondition("test.counted", "enabled", "true"),
    ]


def test_to_conditions_refuses_a_non_scalar_value() -> None:
    with pytest.raises(bus.ValidationError, match="scalar"):
        CourseCreated.to_conditions(course_name=["Algebra"])


def test_a_second_class_with_the_same_tag_is_refused() -> None:
    with pytest.raises(bus.ValidationError, match="already used"):

        class Impostor(bus.Event, tag="test.course.created"):
            course_name: str

    assert event_class("test.course.created") is CourseCreated


def test_an_invalid_tag_is_refused() -> None:
    with pytest.raises(bus.ValidationError, match="invalid event tag"):

        class Spaced(bus.Event, tag="has space"):
            pass


def test_stored_payload_decodes_back_to_the_class_of_its_tag() -> None:
    event = decode_event("test.user.joined_course", '{"course_name": "Algebra", "user_id": "joe"}')
    assert event == UserJoinedCourse(course_name="Algebra", user_id="joe")


def test_a_tag_without_a_class_decodes_as_unknown_event() -> None:
    event = decode_event("nobody.defined.this", '{"a": 1}')
    assert isinstance(event, bus.eventstore.UnknownEvent)
    assert (event.type_tag, event.data) == ("nobody.defined.this", {"a": 1})
