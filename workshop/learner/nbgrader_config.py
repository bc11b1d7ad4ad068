# nbgrader's configuration for every learner's server on the workshop hub (workshop/jupyterhub_config.py
# puts this folder on the servers' JUPYTER_CONFIG_PATH and sets the variables from the course's own
# nbgrader_config.py, so learners and instructor share one exchange folder and one course ID).
import os

c = get_config()  # noqa: F821 (nbgrader defines it)
c.Exchange.root = os.environ["GRADIENTLAB_EXCHANGE"]
c.CourseDirectory.course_id = os.environ["GRADIENTLAB_COURSE_ID"]
# Submit under the hub's name for the learner. nbgrader would take the Unix account, which is the same
# for every learner when all servers run as the hub's own account (SimpleLocalProcessSpawner).
c.CourseDirectory.student_id = os.environ["JUPYTERHUB_USER"]
