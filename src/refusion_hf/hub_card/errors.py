"""Errors of the publishing path. Every one carries a message meant for the user (what is wrong, with which
argument, and what to do); `refusion publish` prints it as one line, without a traceback."""


class PublishError(Exception):
    """Publishing cannot go on; the message says why and what to do."""


class CardInputError(PublishError, ValueError):
    """A card or publishing argument (license, base model, dataset or repo id, decoding default...) is invalid."""


class CardSourceError(PublishError, ValueError):
    """An input file of the card (eval report, trainer state) is missing, unreadable or lacks a required key."""


class PushError(PublishError):
    """The upload to the Hub did not happen or did not complete (no token, rejected token, no network...)."""
