"""Handling of the inbound APIs beside Chat Completions (Responses, Messages): native or translated."""
