"""Pydantic models of the agent-task evaluation (``eval_agent_tasks.py``): the output types users ask for."""

from __future__ import annotations

import datetime
from enum import Enum
from typing import Literal

from pydantic import BaseModel, Field


class City(BaseModel):
    name: str
    country: str
    population_millions: float


class Contact(BaseModel):
    name: str
    email: str = Field(json_schema_extra={"format": "email"})
    phone: str | None = None


class Priority(str, Enum):
    low = "low"
    medium = "medium"
    high = "high"


class Ticket(BaseModel):
    title: str
    priority: Priority
    assignee: str | None = None


class Meeting(BaseModel):
    topic: str
    date: datetime.date
    attendees: list[str]


class Address(BaseModel):
    street: str
    city: str
    postal_code: str


class Person(BaseModel):
    name: str
    age: int
    address: Address


class LineItem(BaseModel):
    product: str
    quantity: int
    unit_price: float


class Invoice(BaseModel):
    invoice_number: str
    customer: str
    items: list[LineItem]


class Inventory(BaseModel):
    counts: dict[str, int]


class Taxon(BaseModel):
    name: str
    children: list[Taxon]


class Book(BaseModel):
    title: str
    author: str
    year: int
    genre: Literal["fiction", "science", "history", "biography", "poetry"]


class Flight(BaseModel):
    airline: str
    flight_number: str
    departure_city: str
    arrival_city: str
    date: datetime.date


class Employee(BaseModel):
    name: str
    title: str
    email: str = Field(json_schema_extra={"format": "email"})
    manager: str | None = None


class Recipe(BaseModel):
    dish: str
    servings: int
    ingredients: list[str]


class Weather(BaseModel):
    city: str
    temperature_c: float
    condition: Literal["sunny", "cloudy", "rain", "snow", "storm"]


class Product(BaseModel):
    name: str
    price: float
    in_stock: bool
    tags: list[str]


class Scores(BaseModel):
    scores: dict[str, int]


class Event(BaseModel):
    name: str
    start: datetime.date
    end: datetime.date
    venue: str


class Team(BaseModel):
    team: str
    members: list[Person]


class OrgUnit(BaseModel):
    name: str
    units: list[OrgUnit]


class Review(BaseModel):
    product: str
    rating: int = Field(ge=1, le=5)
    sentiment: Literal["positive", "neutral", "negative"]


class Company(BaseModel):
    name: str
    founded: int
    headquarters: str
    employees: int
    ceo: str | None = None
