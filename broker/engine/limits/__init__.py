"""Admission: who calls and in which tier, and the rate limits (in process, or shared in Redis)."""
