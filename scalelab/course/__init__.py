"""The course as files: a lab folder (lab), executing a notebook with limits (execute), solution markers
(solutions), student copies (release) and the course website (site). No Jupyter server, no grading here."""
