# nbgrader's configuration for every learner's server on the workshop hub (workshop/jupyterhub_config.py
# puts this folder on the servers' JUPYTER_CONFIG_PATH and sets the variables from the course's own
# nbgrader_config.py, so learners and instructor share one exchange folder and one course ID).
# No student ID: nbgrader submits under the Unix account that runs the server, which on the hub is the
# learner's own, and the instructor's collect files each submission under the account that wrote it.
import os

c = get_config()  # noqa: F821 (nbgrader defines it)
c.Exchange.root = os.environ["GRADIENTLAB_EXCHANGE"]
c.CourseDirectory.course_id = os.environ["GRADIENTLAB_COURSE_ID"]
