"""Run only when Python imports this clone's own folder as ``dlstore``: a script started from the
folder that holds the clone finds the clone before the installed package (an empty namespace
package otherwise, and ``AttributeError: ... no attribute 'CachedDataset'`` far from the cause).
Imported under another name (pytest's collection), it does nothing."""

import os

if __name__ == "dlstore":
    _here = os.path.dirname(os.path.abspath(__file__))
    raise ImportError(
        f"`import dlstore` found {_here}, the folder of dlstore's source clone, not the package inside it "
        f"({os.path.join(_here, 'dlstore')}), because the script runs from {os.path.dirname(_here)}; "
        "run it from another folder, or rename the clone folder"
    )
