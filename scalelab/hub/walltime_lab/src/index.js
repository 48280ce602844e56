// scalelab-walltime: the time left of the student's server job in JupyterLab's status bar, and one warning
// (JupyterLab's Notification API) when it falls under the course's threshold (walltime.warn_s, T-10 min by
// default). The numbers come from the student's own server: GET <base url>/scalelab/walltime (the server extension
// scalelab.hub.walltime, behind the server's normal authentication), asked every `refresh_s` seconds it answers;
// in between the countdown runs on the browser's clock.
//
// Built by build.sh into ../jupyter_data/labextensions/scalelab-walltime (committed, with this file's SHA-256:
// tests/test_hub_walltime.py checks that the bundle was built from this source).
import { Notification } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Widget } from '@lumino/widgets';

const PLUGIN_ID = 'scalelab-walltime:plugin';

// "1:05:09", "4:09": hours only when there are any.
export function formatLeft(seconds) {
  const s = Math.max(0, Math.floor(seconds));
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const pad = n => String(n).padStart(2, '0');
  return h > 0 ? `${h}:${pad(m)}:${pad(s % 60)}` : `${m}:${pad(s % 60)}`;
}

async function fetchWalltime(settings) {
  const url = URLExt.join(settings.baseUrl, 'scalelab', 'walltime');
  const response = await ServerConnection.makeRequest(url, {}, settings);
  if (!response.ok) {
    throw new Error(`${url} answered ${response.status}`);
  }
  return response.json();
}

class WalltimeItem extends Widget {
  constructor() {
    super();
    this.addClass('scalelab-walltime');
    this.node.title = 'Time left of this server\'s Slurm job (scalelab)';
    this.node.style.padding = '0 6px';
    this.end = null; // the job's end, in the browser's clock (ms)
    this.warned = false;
    this.info = null;
  }

  // One answer of the endpoint (not named update: that is Lumino's own, which the status bar calls).
  setInfo(info) {
    this.info = info;
    if (info.left_s === null || info.left_s === undefined) {
      this.end = null;
      this.node.textContent = info.limited === false ? '' : 'walltime: ?';
      return;
    }
    this.end = Date.now() + info.left_s * 1000;
    this.tick();
  }

  tick() {
    if (this.end === null || this.info === null) {
      return;
    }
    const left = (this.end - Date.now()) / 1000;
    const warn = this.info.warn_s > 0 && left <= this.info.warn_s;
    this.node.textContent = `Job ${this.info.job_id}: ${formatLeft(left)} left`;
    this.node.style.color = warn ? 'var(--jp-warn-color0, #b45309)' : '';
    this.node.style.fontWeight = warn ? 'bold' : '';
    if (warn && !this.warned) {
      this.warned = true;
      Notification.warning(this.info.warning || `This server stops in ${formatLeft(left)}: save your work.`,
        { autoClose: false });
    }
  }
}

const plugin = {
  id: PLUGIN_ID,
  description: 'Time left of the server job and a warning before its end (scalelab).',
  autoStart: true,
  optional: [IStatusBar],
  activate: (app, statusBar) => {
    const settings = ServerConnection.makeSettings();
    const item = new WalltimeItem();
    if (statusBar) {
      statusBar.registerStatusItem(PLUGIN_ID, { item, align: 'left', rank: 100 });
    }
    let refresh = 60;
    const ask = async () => {
      try {
        const info = await fetchWalltime(settings);
        item.setInfo(info);
        refresh = Math.max(5, info.refresh_s || 60);
      } catch (err) {
        console.warn('scalelab-walltime:', err);
      }
      setTimeout(ask, refresh * 1000);
    };
    void ask();
    setInterval(() => item.tick(), 1000);
  }
};

export default plugin;
