"""nbgrader's exchange for a room where each learner is a Unix account (the workshop hub).

nbgrader files a submission under the name its folder claims (``NAME+ASSIGNMENT+TIME``) and only warns when
the folder's owner is someone else, so a learner could submit under another learner's name (`nbgrader
submit --student bo`, or a folder written into the inbound by hand). `OwnersCollect`, which the course's
``nbgrader_config.py`` names, collects each submission as its owner's: a learner's folder counts for that
learner whatever it claims. A folder owned by the collecting account itself (an instructor submitting for a
learner, or a room run under one account) keeps the name it claims.
"""

from __future__ import annotations

import os
import pwd

from nbgrader.exchange.default.collect import ExchangeCollect

__all__: list[str] = []


class OwnersCollect(ExchangeCollect):
    """`nbgrader collect` that files each submission under the account that owns it."""

    def _path_to_record(self, path):
        record = super()._path_to_record(path)
        owner = os.stat(os.path.join(self.inbound_path, record["filename"])).st_uid
        if owner != os.geteuid():
            try:
                name = pwd.getpwuid(owner).pw_name
            except KeyError:
                name = f"uid{owner}"
            if name != record["username"]:
                self.log.warning("%s claims to be %s's submission but %s wrote it: collected as %s's",
                                 record["filename"], record["username"], name, name)
                record["username"] = name
        return record
