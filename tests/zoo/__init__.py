"""The zoo: small web apps with one planted performance problem each, next to a clean twin.

Each problem module (``<framework>_<problem>.py``) serves a ``/<problem>/bad`` endpoint with the
problem and a ``/<problem>/clean`` endpoint with it fixed; the line that causes the problem is
marked ``# PLANTED: <kind>`` (tests read the line number from the source). ``catalog`` lists
them, ``harness`` runs them under the agent and asks ``perfsleuth findings`` what it found.
"""
