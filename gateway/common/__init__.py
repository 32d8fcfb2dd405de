"""The few modules every package may use: the API's errors, generation IDs, deadlines.

Owns: ``APIError`` and its constructors (the OpenAI error format), generation IDs and the
tenant cache salt, the deadline sweep. Imports nothing from the gateway: this is the ground floor.
"""
