"""The trials of the reliability review that ended in a traceback, a hang, a silent wrong answer or
a leak: each is replayed by a test marked `@pytest.mark.trial("ID")` (tests/reliability/)."""

TRIALS_TO_REPLAY = frozenset("""
    T5 T5opt T8c T18 T19 T14 T17c T17d T17e T10c
    C5 C6 C9 C12 A5 A6
    M2b M2c M4b M4c M23 M7e M7i M7k M7h M7j M9b M9d M10 M12 M13b M17 M22
    P4d P4f P4g P5c P5d P7c P9e P10e
    G1b G4 G4b G8a G8b G8e G8f G9b
    R2f R7b R16 R9b R9b2 R9c R9d R9e R10 R10b R10s R11 R13 R14 R20 R23 D1 W3
    S3 PR4 PR5 PR6-7
    PG5 PG6 PG7 PG8 PG9 PG10 PG11 PG12 PG13 PG14 PG15 PG21 PG24 PG28 PG30
""".split())
